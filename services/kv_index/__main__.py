from services.kv_index.main import main

raise SystemExit(main())
