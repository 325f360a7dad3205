"""NIXL's progress thread sleeps between polls when the KV pool is in host memory.

nixl's Python API gives its bindings an agent config with ``pthrDelay = 0``,
so the UCX progress thread busy-polls a CPU core per process. With the KV pool
in host memory (``--device cpu``) the manager sets the delay on that config;
on an accelerator nothing changes.

No real NIXL agent is built: a stand-in for the module that defines
``nixl_agent`` has a ``nixlBind.nixlAgent`` that records the config it gets,
and a fake ``nixl_agent`` builds its config and calls it like nixl 1.5.1 does.
"""

import sys
import types
import unittest
from types import SimpleNamespace
from unittest import mock

from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.nixl import conn as nixl_conn
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

FAKE_API = "fake_nixl_api_for_progress_thread_test"
DELAY = nixl_conn.NIXL_HOST_PROGRESS_THREAD_DELAY_US


class _Stop(Exception):
    pass


def device(name: str):
    return SimpleNamespace(device=name, gpu_id=0)


def fake_nixl_api(bind_agent=None, name: str = FAKE_API):
    """A module like nixl_cu13._api: ``nixl_agent`` builds a bindings config
    with pthrDelay = 0 and hands it to ``nixlBind.nixlAgent``."""
    api = types.ModuleType(name)
    api.built = []  # (name, config) each bindings agent was built with
    if bind_agent is None:

        def bind_agent(agent_name, agent_config):
            api.built.append((agent_name, agent_config))
            return SimpleNamespace(name=agent_name)

    api.nixlBind = types.SimpleNamespace(nixlAgent=bind_agent)

    class nixl_agent:
        def __init__(self, agent_name, nixl_conf=None):
            agent_config = SimpleNamespace(useProgThread=True, pthrDelay=0)
            self.agent = api.nixlBind.nixlAgent(agent_name, agent_config)
            self.conf = nixl_conf

    nixl_agent.__module__ = name
    api.nixl_agent = nixl_agent
    return api


class TestCreateNixlAgent(CustomTestCase):
    def create(self, api, device_name: str):
        with (
            mock.patch.dict(sys.modules, {api.__name__: api}),
            mock.patch.object(nixl_conn, "get_device", lambda: device(device_name)),
        ):
            return nixl_conn._create_nixl_agent(api.nixl_agent, "agent-a", "conf")

    def test_host_kv_pool_sets_the_delay_on_the_bindings_config(self):
        api = fake_nixl_api()
        original = api.nixlBind.nixlAgent
        agent = self.create(api, "cpu")
        self.assertEqual(len(api.built), 1)
        name, config = api.built[0]
        self.assertEqual(name, "agent-a")
        self.assertEqual(config.pthrDelay, DELAY)
        self.assertGreater(DELAY, 0)
        self.assertTrue(config.useProgThread)
        self.assertEqual(agent.agent.name, "agent-a")
        self.assertEqual(agent.conf, "conf")
        self.assertIs(api.nixlBind.nixlAgent, original)

    def test_the_constructor_is_restored_when_the_agent_fails(self):
        def failing(agent_name, agent_config):
            raise RuntimeError("no plugins")

        api = fake_nixl_api(failing)
        with self.assertRaisesRegex(RuntimeError, "no plugins"):
            self.create(api, "cpu")
        self.assertIs(api.nixlBind.nixlAgent, failing)

    def test_accelerator_kv_pool_changes_nothing(self):
        seen = []
        api = fake_nixl_api()
        original = api.nixlBind.nixlAgent

        def recording(agent_name, agent_config):
            seen.append(api.nixlBind.nixlAgent)
            return original(agent_name, agent_config)

        api.nixlBind.nixlAgent = recording
        for name in ("cuda", "cuda:1"):
            self.create(api, name)
        self.assertEqual(seen, [recording, recording])
        self.assertEqual([c.pthrDelay for _, c in api.built], [0, 0])
        self.assertIs(api.nixlBind.nixlAgent, recording)

    def built_without_bindings_constructor(self, api_name: str, bind=None):
        """Another nixl version: no ``nixlBind.nixlAgent`` to wrap."""
        api = types.ModuleType(api_name)
        if bind is not None:
            api.nixlBind = bind

        class nixl_agent:
            def __init__(self, agent_name, nixl_conf=None):
                self.name = agent_name
                self.conf = nixl_conf

        nixl_agent.__module__ = api_name
        with self.assertLogs(nixl_conn.logger, "WARNING") as logs:
            agent = self.create(
                SimpleNamespace(__name__=api_name, nixl_agent=nixl_agent), "cpu"
            )
        self.assertEqual((agent.name, agent.conf), ("agent-a", "conf"))
        self.assertEqual(len(logs.output), 1)
        self.assertIn("nixlBind.nixlAgent", logs.output[0])
        self.assertIn("busy-polls", logs.output[0])

    def test_missing_bindings_constructor_only_logs(self):
        bind = SimpleNamespace()
        self.built_without_bindings_constructor(FAKE_API, bind)
        self.assertEqual(vars(bind), {})

    def test_module_without_bindings_only_logs(self):
        self.built_without_bindings_constructor(FAKE_API)

    def test_config_without_the_field_only_logs(self):
        class OldConfig:
            __slots__ = ("useProgThread",)

        api = fake_nixl_api()
        original = api.nixlBind.nixlAgent

        class nixl_agent:
            def __init__(self, agent_name, nixl_conf=None):
                config = OldConfig()
                config.useProgThread = True
                self.agent = api.nixlBind.nixlAgent(agent_name, config)

        nixl_agent.__module__ = api.__name__
        api.nixl_agent = nixl_agent
        with self.assertLogs(nixl_conn.logger, "WARNING") as logs:
            agent = self.create(api, "cpu")
        self.assertEqual(agent.agent.name, "agent-a")
        self.assertIn("pthrDelay", logs.output[0])
        self.assertIs(api.nixlBind.nixlAgent, original)


class TestNixlKVManagerAgent(CustomTestCase):
    """NixlKVManager.__init__ builds its agent through the helper."""

    def configs_built(self, device_name: str, mode: DisaggregationMode):
        api = fake_nixl_api(name="nixl._api")
        bind_agent = api.nixlBind.nixlAgent

        def stop_after_build(agent_name, agent_config):
            bind_agent(agent_name, agent_config)
            raise _Stop

        api.nixlBind.nixlAgent = stop_after_build
        api.nixl_agent_config = lambda **kw: SimpleNamespace(**kw)
        api.nixl_thread_sync_t = SimpleNamespace(NIXL_THREAD_SYNC_STRICT="strict")
        kv_args = SimpleNamespace(
            kv_data_ptrs=[1, 2], kv_data_mem_kinds=None, ib_device=None, gpu_id=0
        )

        def fake_common_init(self, args, *_):
            self.kv_args = args

        mgr = nixl_conn.NixlKVManager.__new__(nixl_conn.NixlKVManager)
        with (
            mock.patch.object(nixl_conn, "get_device", lambda: device(device_name)),
            mock.patch.object(CommonKVManager, "__init__", fake_common_init),
            mock.patch.dict(sys.modules, {"nixl._api": api}),
        ):
            with self.assertRaises(_Stop):
                mgr.__init__(kv_args, mode, None)
        self.assertIs(api.nixlBind.nixlAgent, stop_after_build)
        return [config for _, config in api.built]

    def test_prefill_and_decode_on_host_sleep_between_polls(self):
        for mode in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
            with self.subTest(mode=mode):
                configs = self.configs_built("cpu", mode)
                self.assertEqual([c.pthrDelay for c in configs], [DELAY])

    def test_cuda_keeps_nixl_defaults(self):
        for mode in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
            with self.subTest(mode=mode):
                configs = self.configs_built("cuda", mode)
                self.assertEqual([c.pthrDelay for c in configs], [0])


if __name__ == "__main__":
    unittest.main()
