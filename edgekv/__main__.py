"""``python -m edgekv`` = the ``edgekv`` command (handy in a checkout that is not pip-installed)."""

from .cli import app

app()
