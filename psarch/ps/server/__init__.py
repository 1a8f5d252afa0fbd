"""One parameter server, built by composition: `ParameterServer` (parameter_server.py) holds a `ServerState`
(state.py) and hands it to its parts, each request going to its part through one handler table."""
