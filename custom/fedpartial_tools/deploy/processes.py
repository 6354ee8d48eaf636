"""The processes of a FLARE system started from startup kits: the site command's helpers
(:mod:`fedpartial.site.kit_processes`, shipped in the runtime wheel), re-exported for the tooling."""
from fedpartial.site.kit_processes import (kill_workspace_processes, live_workspace_processes, start_kit,  # noqa: F401
                                       stop_group, workspace_processes)
