"""The ``joblock`` command and what it needs: the demo, the benchmarks, lock inspection,
and throwaway Redis servers (which the test suite uses too)."""
