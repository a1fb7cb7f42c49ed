from services.swa_memcache.main import main

raise SystemExit(main())
