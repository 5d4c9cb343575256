"""Remote (L3) stores: the built-in ``tkv://`` server and client, and Redis/Valkey.

`connector.RemoteConnector` is the seam; `client.TkvConnector` and `redis.RedisConnector`
implement it, `protocol` is the wire format of the built-in server (`server`).
"""
