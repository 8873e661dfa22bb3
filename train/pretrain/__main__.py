from train.pretrain.engine import main

raise SystemExit(main())
