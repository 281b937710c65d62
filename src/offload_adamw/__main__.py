import sys

from offload_adamw.cli.main import main

sys.exit(main())
