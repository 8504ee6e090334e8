"""Spot notices: each cloud's notice read from a double of its node metadata service (tests/support/metadata_double.py)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from gpuflow.cluster.job.notices import MetadataService, CLOUDS, NotThisCloud, azure_notice, detect
from tests.support.metadata_double import metadata_double
from tests.support.servers import free_port


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_a_notice_is_read_as_the_cloud_gives_it(cloud):
    with metadata_double(cloud) as double:
        service = detect(f"{double.url}/node-a")
        assert service is not None and service.cloud.name == cloud
        assert service.check() is None and double.polls["node-a"] >= 1
        deadline = double.notify("node-a", in_s=30)
        seen = time.time()
        notice = service.check()
        assert notice is not None and notice.cloud == cloud
        # AWS says the time; GCP says only TRUE, its usual 30 s counted from when it is seen
        assert notice.deadline_s == pytest.approx(deadline if cloud == "aws" else seen + 30, abs=1.5)
        assert detect(f"{double.url}/node-b").check() is None, "another node's service has no notice"


def test_each_cloud_is_told_from_the_others():
    with metadata_double("aws") as aws, metadata_double("gcp") as gcp:
        assert detect(aws.url, clouds=("gcp", "azure")) is None
        assert detect(gcp.url, clouds=("aws", "azure")) is None
        # on GCP, an AWS token is no answer; the AWS service asks for its token before any answer
        with pytest.raises(NotThisCloud):
            MetadataService(CLOUDS["aws"], gcp.url).check()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{aws.url}/latest/meta-data/spot/instance-action", timeout=5)
        assert refused.value.code == 401


def test_no_metadata_service_means_no_watch():
    assert detect(f"http://127.0.0.1:{free_port()}", timeout_s=1) is None


def test_an_azure_preempt_event_for_this_vm_is_a_notice():
    def events(*listed):
        return json.dumps({"DocumentIncarnation": 2, "Events": list(listed)}).encode()

    freeze = {"EventId": "1", "EventType": "Freeze", "Resources": ["vm-a"], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}
    preempt = {"EventId": "2", "EventType": "Preempt", "Resources": ["vm-b"], "EventStatus": "Scheduled",
               "NotBefore": "Mon, 19 Sep 2016 18:30:17 GMT"}
    assert azure_notice(200, events(), 0.0) is None
    assert azure_notice(200, events(freeze), 0.0, "vm-a") is None
    assert azure_notice(200, events(preempt), 0.0, "vm-a") is None, "another VM's event"
    notice = azure_notice(200, events(freeze, preempt), 0.0, "vm-b")
    assert notice.cloud == "azure" and notice.deadline_s == 1474309817.0
    with pytest.raises(NotThisCloud):
        azure_notice(404, b"<html>not here</html>", 0.0)

