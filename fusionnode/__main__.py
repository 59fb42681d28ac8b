import sys

from fusionnode.cli import main

sys.exit(main())
