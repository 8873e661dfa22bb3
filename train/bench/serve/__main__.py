from train.bench.serve.job import main

raise SystemExit(main())
