"""The test rig: what only the suite, the chaos run and the run scripts use.

The fault proxy (``faults``), a local Sentinel deployment (``sentinels``), a slot moved
by hand between the primaries of a local Cluster (``migration``) and the chaos run with
its workers (``chaos``, ``chaos_work``). The servers and clusters that ``joblock bench``,
``joblock demo`` and the ``joblock.testing`` plugin start stay in the package
(``joblock._tools.servers``). Importable as ``rig`` from the suite (pytest puts
``tests/`` on the path) and from ``scripts/``, which put it there themselves.
"""
