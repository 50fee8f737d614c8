"""The ``trainpilot`` console script: thin verbs that parse, call the layer below and print."""
