import sys

from blazar.cli.main import main

sys.exit(main())
