import sys

from pilotfish.cli import main

sys.exit(main())
