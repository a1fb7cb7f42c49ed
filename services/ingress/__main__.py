from services.ingress.main import main

raise SystemExit(main())
