from train.eval.evaluate import main

raise SystemExit(main())
