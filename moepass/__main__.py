import sys

from moepass.cli import main

sys.exit(main())
