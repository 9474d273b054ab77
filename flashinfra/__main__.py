import sys

from flashinfra.cli import main

sys.exit(main())
