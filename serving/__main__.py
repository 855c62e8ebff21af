"""``python -m serving``: the server process (``serving.server.main``)."""

from serving.server import main

main()
