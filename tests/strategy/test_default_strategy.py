"""The shared bodies under the default strategy and OneDeviceStrategy."""

import tensorflow as tf

from tests.harness.bodies import StrategyBodies


class DefaultStrategyEagerTest(StrategyBodies, tf.test.TestCase):
    eager = True

    @property
    def strategy(self):
        return tf.distribute.get_strategy()


class DefaultStrategyFunctionTest(StrategyBodies, tf.test.TestCase):
    @property
    def strategy(self):
        return tf.distribute.get_strategy()

    def execute(self, fn, *args):
        return fn(*args)


class OneDeviceStrategyTest(StrategyBodies, tf.test.TestCase):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")

    def execute(self, fn, *args):
        return self.strategy.run(fn, args=args)


if __name__ == "__main__":
    tf.test.main()
