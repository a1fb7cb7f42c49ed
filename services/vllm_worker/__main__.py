from services.vllm_worker.main import main

raise SystemExit(main())
