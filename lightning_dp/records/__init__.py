"""The records a step draws: read as the loader's fetcher does, fingerprinted, counted."""
