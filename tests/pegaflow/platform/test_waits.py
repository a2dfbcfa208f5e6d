"""pegaflow/platform/waits.py: the doorbell wakes a consumer asleep on an empty ring promptly,
and costs a producer no semaphore post while the consumer is awake."""

from __future__ import annotations

import threading

from pegaflow.platform.ring import RingConsumer, RingProducer
from pegaflow.platform.waits import Doorbell
from tests.pegaflow.platform.ring_records import WAIT_S, doorbell_semaphore, fields_of, new_slots, record_for


def test_doorbell_wakes_a_sleeping_consumer_promptly():
    with doorbell_semaphore() as (sem, flag):
        slots = new_slots(4)
        producer, consumer = RingProducer(slots, Doorbell(sem, flag)), RingConsumer(slots, Doorbell(sem, flag))
        # 1. The consumer waits up to an hour; the producer publishes after 200 ms.
        timer = threading.Timer(0.2, lambda: producer.put_fields(fields_of(record_for(1)), 1.0))
        timer.start()
        got = []
        waiter = threading.Thread(target=lambda: got.append(consumer.get(3600.0)), daemon=True)
        waiter.start()
        # 2. It wakes on the doorbell, not at its deadline (a lost wake-up would keep it
        #    asleep far past the generous wait here).
        waiter.join(WAIT_S)
        assert not waiter.is_alive() and got[0]["command_id"] == 1
        timer.join()
        # 3. And it lowered its sleeping flag once awake.
        assert flag[0] == 0


def test_doorbell_does_not_post_while_the_consumer_is_awake():
    with doorbell_semaphore() as (sem, flag):
        producer = RingProducer(new_slots(4), Doorbell(sem, flag))
        # 1. The consumer is not sleeping: publishing costs no semaphore post.
        producer.put_fields(fields_of(record_for(0)), 1.0)
        assert sem.value == 0
        # 2. With the flag raised, a publish posts once.
        flag[0] = 1
        producer.put_fields(fields_of(record_for(1)), 1.0)
        assert sem.value == 1
