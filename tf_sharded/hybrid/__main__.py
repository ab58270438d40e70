"""`python -m tf_sharded.hybrid [ADDRESS]`: a table server, at ADDRESS or as its `ps` task of `TF_CONFIG`."""

import sys

from tf_sharded.hybrid.server import main

if __name__ == "__main__":
    sys.exit(main())
