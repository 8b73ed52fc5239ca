"""``edgekv simulate``: will this model, budget and block fit the memory a phone app gets,
and how fast will it be there? A host run under an enforced memory cap (child process) plus
a roofline estimate per device profile.

Modules: ``profiles`` (device files + validation), ``limits`` (cap mechanisms), ``child`` /
``runner`` (the job in a capped child process), ``work`` + ``roofline`` (device estimates),
``sweep`` (longest prompt per cap, speed curves, plot), ``report`` (tables), ``command``
(the flow behind the CLI). This file imports nothing: the child imports the package before
it applies the cap and imports torch."""
