"""``python -m fedpartial_tools.deploy <command>``: POC, provisioning and certificate commands
(:mod:`.cli`)."""
from fedpartial_tools.deploy.cli import main

main()
