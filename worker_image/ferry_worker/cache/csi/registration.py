"""The kubelet's plugin registration (pluginregistration.v1), served by the
agent itself in place of the node-driver-registrar sidecar: the kubelet
watches <kubelet>/plugins_registry/, calls GetInfo on a new socket, registers
the driver (the CSINode object lists it) and reports the outcome."""
from __future__ import annotations

import logging

from .proto import pluginregistration_pb2 as pb, pluginregistration_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CSI_VERSIONS = ["1.0.0"]


class Registration(pb_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: str):
        self.driver, self.endpoint = driver, endpoint
        self.registered: bool | None = None  # what the kubelet last said

    def GetInfo(self, request, context):
        return pb.PluginInfo(type="CSIPlugin", name=self.driver, endpoint=self.endpoint,
                             supported_versions=CSI_VERSIONS)

    def NotifyRegistrationStatus(self, request, context):
        self.registered = request.plugin_registered
        if request.plugin_registered:
            log.info("the kubelet registered %s at %s", self.driver, self.endpoint)
        else:
            log.error("the kubelet refused to register %s: %s", self.driver, request.error)
        return pb.RegistrationStatusResponse()
