"""The ``sluicegate`` command line (typer): one module per command group; ``main`` assembles them."""
