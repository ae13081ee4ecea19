from .generate import main
import sys

sys.exit(main())
