"""Stable public name: ``fedpartial_tools.provision_builders.SitePolicyBuilder``, the builder path in
consortia's project.yml (provisioning/project*.yml); the code lives in :mod:`fedpartial_tools.deploy.builders`."""
from fedpartial_tools.deploy.builders import SitePolicyBuilder  # noqa: F401
