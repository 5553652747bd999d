"""Gradient compression: one module per method, each exporting one :class:`~.method.Method` record.

:mod:`.registry` lists them and installs the configured one on a DDP model; :mod:`.method` says what a record holds.
`auto` (:mod:`.auto`) is a method too, one that measures the others and runs the fastest.
"""
