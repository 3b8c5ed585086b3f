"""STAND-IN for vllm/plugins/__init__.py: load_general_plugins() runs, once
per process, every entry point of the group 'vllm.general_plugins' whose name
$VLLM_PLUGINS (comma-separated) allows (unset: all). vLLM calls it in every
process it starts, workers included; that is how an installed shmcast
registers its backend. Written for shmcast's tests; not vLLM's code."""
import logging
import os
from importlib.metadata import entry_points

DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
_loaded = False
logger = logging.getLogger(__name__)


def load_general_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed = None if allowed is None else [p.strip() for p in allowed.split(",") if p.strip()]
    try:
        eps = entry_points(group=DEFAULT_PLUGINS_GROUP)
    except TypeError:  # Python < 3.10
        eps = entry_points().get(DEFAULT_PLUGINS_GROUP, [])
    for ep in eps:
        if allowed is None or ep.name in allowed:
            try:
                ep.load()()
            except Exception:  # vLLM logs a failing plugin and goes on
                logger.exception("Failed to load plugin %s", ep.name)
