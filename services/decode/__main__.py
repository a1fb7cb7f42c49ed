from services.decode.main import main

raise SystemExit(main())
