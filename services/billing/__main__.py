from services.billing.main import main

raise SystemExit(main())
