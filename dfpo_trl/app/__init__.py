"""The ``dfpo-train`` program: a recipe in, a trained model, its summary and its figure out (``main.py`` runs it).

Its modules, in the order a run uses them: ``main`` with ``precheck``, ``paths``, ``files`` and the stored field
table (``fields``, ``field_table.json``), ``help`` and ``signals`` (``--help`` and the checks that need no torch, then
SIGTERM handled like Ctrl-C); ``train`` (the run, once those checks passed); ``args`` (the script arguments),
``plugins`` (modules imported before the recipe is checked), ``parser`` (recipe and flags into dataclasses),
``model`` (which model to load), ``data`` (task, rewards, datasets), ``evaluation``, ``callbacks`` and
``progress`` (what a run measures and shows while it trains), ``outputs`` and ``plotting`` (what it writes),
``resume`` (checkpoints and resuming beyond the trainer), ``embedded`` (the offline default model).
"""

import logging

# The program's log channel: its name heads every line dfpo-train logs ("INFO dfpo_trl.app: ...").
logger = logging.getLogger("dfpo_trl.app")
