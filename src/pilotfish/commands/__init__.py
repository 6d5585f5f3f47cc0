"""The command line: :mod:`~pilotfish.commands.cli` parses flags into settings, :mod:`~pilotfish.commands.demo`
runs the demo, :mod:`~pilotfish.commands.operate` holds ``status`` / ``wait`` / ``confirm`` (clients of the
admin API).

May import every other package; nothing imports it but ``__main__``. Heavy parts (the server) are
imported lazily, by the command that needs them.
"""
