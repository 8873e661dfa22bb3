from train.adapter.engine import main

raise SystemExit(main())
