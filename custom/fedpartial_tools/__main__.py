"""``python -m fedpartial_tools ...``: the user's commands of ``python -m fedpartial`` plus the
developer's (bench, bench-report, throughput, jobs, harmonise)."""
from fedpartial_tools.cli import main

main(developer=True)
