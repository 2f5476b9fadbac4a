"""What a careless user meets: every mistake is a kvxfer error that says what is wrong."""

import socket
import threading

import numpy as np
import pytest

from kvxfer import ConfigError, Consumer, KVLayout, Producer, ProtocolError


def _layout():
    return KVLayout.from_tensors([np.zeros((8, 2, 4, 8), np.float16) for _ in range(2)])


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1:http", "127.0.0.1:99999", "", "127.0.0.1: 80", None])
def test_malformed_addresses_are_config_errors(address):
    with Producer(_layout(), transport="tcp") as p, pytest.raises(ConfigError):
        p.push(address, "r", [1]).wait(5)
    with pytest.raises(ConfigError):
        Consumer(_layout(), transport="tcp", listen=address)


def test_pushing_to_an_http_port_says_so():
    server = socket.create_server(("127.0.0.1", 0))

    def http_server():  # answers whatever arrives the way HTTP servers answer garbage
        conn, _ = server.accept()
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        conn.close()

    threading.Thread(target=http_server, daemon=True).start()
    with Producer(_layout(), transport="tcp") as p, pytest.raises(ProtocolError, match="HTTP"):
        p.push(f"127.0.0.1:{server.getsockname()[1]}", "r", [1]).wait(5)
    server.close()
