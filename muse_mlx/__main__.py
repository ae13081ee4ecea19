from . import cli
from .generate import main

cli.exit_now(main())
