"""ferry services: each subpackage is one process (`python -m ferry_services.<name>`)."""
