"""``python -m fedpartial_tools ...`` = ``python -m fedpartial ...``."""
from fedpartial_tools.cli import main

main()
