from tfla.cli import main

raise SystemExit(main())
