"""Layout planner: enumerate dp x tp x pp x ep x dp flavour x micro-batch x recompute x schedule x virtual stages
x SP, keep what fits, rank by predicted step time (search.py; the pool re-timed and the top confirmed in retime.py)."""

import numpy.ma  # noqa: F401  (np.unique imports numpy.ma on its first call, ~15 ms: done at import, not mid-search)
