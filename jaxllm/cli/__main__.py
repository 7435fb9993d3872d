"""``python -m jaxllm.cli``: the jaxllm command."""
import sys

from . import main

sys.exit(main())
