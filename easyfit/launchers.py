"""The values of fit's `launcher=` option beyond "auto" and "ray": `easyfit.launchers.Ray(...)` with Ray Train's
options (docs/ray.md). Importing this module imports no Ray."""
from easyfit.distributed.launcher_choice import Ray

__all__ = ["Ray"]
