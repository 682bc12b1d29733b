import sys

from fragsim.cli import main

sys.exit(main())
