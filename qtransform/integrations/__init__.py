"""Glue for the trainers and engines our users run (TRL, vLLM). Each module imports its library
lazily or at its own import, never from `import qtransform`: the libraries are optional extras."""
