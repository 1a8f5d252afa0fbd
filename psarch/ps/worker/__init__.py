"""One parameter-server worker: `PSWorker` (trainer.py, the backend's Trainer) holds its parts: the link to
the servers for the flat parameters, GEO's local optimizer, and with embedding rows the batch's rows."""
