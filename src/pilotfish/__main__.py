import sys

from pilotfish.commands.cli import main

sys.exit(main())
