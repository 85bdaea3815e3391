from kvgate.cli import main

raise SystemExit(main())
