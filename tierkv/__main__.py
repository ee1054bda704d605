from tierkv.cli import main

raise SystemExit(main())
