"""``python -m fedpartial ...``: the command line lives in the tooling package
(:mod:`fedpartial_tools.cli`); this shim is not shipped to sites."""
from fedpartial_tools.cli import main

main()
