"""Child processes and the sockets they share, for any launcher: `pagoda serve`'s (launch/, cli/serve.py) and
`pagoda router --workers`'s. Generic: nothing here knows the engine, the server or a tool."""
