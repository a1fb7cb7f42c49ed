from services.prefill.main import main

raise SystemExit(main())
